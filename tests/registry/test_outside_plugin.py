"""A plugin built and pip-installed from outside the repository, as a third party would: it brings an architecture
whose model_type transformers does not know, and registers its config class through ``xinfer_config_classes``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from transformers import LlamaConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tests.tiny_models import COMMON, prompt, save_tiny_model

PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "xinfer-tinynet"
version = "0.2.0"
dependencies = ["pyxinfer", "xinfer-llama"]

[project.entry-points.xinfer]
tinynet = "xinfer_tinynet"
"""

MODULE = '''
from transformers import LlamaConfig

from xinfer.hooks import hookimpl
from xinfer_llama.llama import LlamaForCausalLM


class TinyNetConfig(LlamaConfig):
    model_type = "tinynet"


class TinyNetForCausalLM(LlamaForCausalLM):
    """A Llama under a model_type of its own."""


@hookimpl
def xinfer_config_classes():
    return {"tinynet": "xinfer_tinynet:TinyNetConfig"}


@hookimpl
def xinfer_architectures():
    return {"TinyNetForCausalLM": "xinfer_tinynet:TinyNetForCausalLM"}
'''

RUN = """
import json, sys
from xinfer import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", num_blocks=32)
out = llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "model_type": llm.engine.hf_config.model_type}))
"""


def test_a_plugin_from_outside_the_repo_brings_a_new_model_type(tmp_path):
    assert "tinynet" not in CONFIG_MAPPING  # what the hook is for
    package = tmp_path / "xinfer-tinynet"
    package.mkdir()
    (package / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (package / "xinfer_tinynet.py").write_text(textwrap.dedent(MODULE))
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(package)],
        cwd=tmp_path, check=True,
    )  # fmt: skip
    model_dir = tmp_path / "model"
    hf = save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="tinynet", architectures=["TinyNetForCausalLM"])
    (model_dir / "config.json").write_text(json.dumps(config))

    tokens = prompt(20)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", RUN, str(model_dir), json.dumps(tokens)], cwd=tmp_path, env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    expected = hf.generate(torch.tensor([tokens]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert got == {"tokens": expected[0, len(tokens) :].tolist(), "model_type": "tinynet"}
