"""``--hf-overrides``: config fields replaced before the config is read, a sub-config's merged."""

from transformers import Qwen3VLConfig

from xinfer.loading.overrides import overridden


def test_a_field_is_replaced_whole_and_a_sub_configs_fields_merged():
    fields = {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "text_config": {"hidden_size": 64, "rope_theta": 1},
    }
    overrides = {"rope_scaling": {"rope_type": "yarn"}, "text_config": {"rope_theta": 5}}
    assert overridden(fields, overrides, Qwen3VLConfig) == {
        "rope_scaling": {"rope_type": "yarn"},
        "text_config": {"hidden_size": 64, "rope_theta": 5},
    }


def test_the_overrides_are_copied_not_shared_with_the_config():
    """transformers completes a config's rope dict in place: the settings' dict must not change with it."""
    overrides = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    overridden({}, overrides)["rope_scaling"]["rope_theta"] = 1e6
    assert overrides == {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
