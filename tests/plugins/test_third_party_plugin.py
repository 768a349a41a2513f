"""A plugin made here, as a third party would: its own package, pyproject and entry
point, built and installed with pip. It composes core blocks alone, imports no other
plugin, and xinfer loads its architecture unchanged."""

import json
import os
import subprocess
import sys
import textwrap

import torch
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prompt, save_tiny_model

PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "xinfer-tinynet"
version = "0.0.7"

[project.entry-points.xinfer]
tinynet = "xinfer_tinynet"
"""

MODULE = '''
from xinfer.hooks import hookimpl
from xinfer.layers import DecoderForCausalLM


class TinyNetForCausalLM(DecoderForCausalLM):
    """A llama-like decoder built by a third party from xinfer's blocks alone."""


@hookimpl
def xinfer_architectures():
    return {"TinyNetForCausalLM": "xinfer_tinynet:TinyNetForCausalLM"}
'''

RUN = """
import json, sys
from xinfer import LLM, SamplingParams
from xinfer.registry import plugins
llm = LLM(model=sys.argv[1], dtype="float32", num_blocks=32)
out = llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
info = next(p for p in plugins() if p.name == "tinynet")
packages = sorted({m.split(".")[0] for m in sys.modules if m.startswith("xinfer_")})
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "version": info.version, "archs": info.architectures,
                  "packages": packages}))
"""


def test_a_pip_installed_plugin_adds_an_architecture(tmp_path):
    package = tmp_path / "xinfer-tinynet"
    package.mkdir()
    (package / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (package / "xinfer_tinynet.py").write_text(textwrap.dedent(MODULE))
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(package),
        ],
        check=True,
    )
    model_dir = tmp_path / "model"
    hf = save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["TinyNetForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))

    tokens = prompt(20)
    pythonpath = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath, "XINFER_PLUGINS": "tinynet,cpu"}
    result = subprocess.run(
        [sys.executable, "-c", RUN, str(model_dir), json.dumps(tokens)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(result.stdout.strip().splitlines()[-1])
    expected = hf.generate(torch.tensor([tokens]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert got["tokens"] == expected[0, len(tokens) :].tolist()
    assert got["version"] == "0.0.7" and got["archs"] == ["TinyNetForCausalLM"]
    assert got["packages"] == ["xinfer_cpu", "xinfer_tinynet"], "a plugin other than tinynet and cpu was imported"


def test_xinfer_plugins_env_var_limits_loaded_plugins():
    code = "from xinfer.registry import plugins; print(sorted(p.name for p in plugins()))"
    env = {**os.environ, "XINFER_PLUGINS": "llama,cpu"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "['cpu', 'llama']"
