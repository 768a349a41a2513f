"""The plugin-author guide's example (docs/plugins.md) is real: its files, extracted from the page, are pip-installed
from a folder outside the repository, and its architectures, op and GGUF adapter agree with references no one here
wrote (transformers' models and activation, llama.cpp's q/k permutation). docs/architecture.md's table of hooks is
checked against the hook specifications, and each of its examples is what an installed plugin registers."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import ArceeConfig, HeliumConfig

from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import hooks

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
ARCHITECTURE = GUIDE.parent / "architecture.md"
HOOK_ROW = re.compile(r"^\| `(xinfer_\w+)\(\) -> ([^`]+)` \| [^|]+ \| `(.+)` \|$", re.MULTILINE)
FILE_BLOCK = re.compile(r"^```\w+ file=(\S+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
TINY = dict(COMMON, head_dim=16)


def guide_files() -> dict[str, str]:
    blocks = FILE_BLOCK.findall(GUIDE.read_text())
    names = [name for name, _ in blocks]
    assert len(names) == len(set(names)), f"a file is shown twice in {GUIDE.name}: {names}"
    return dict(blocks)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The guide's plugin folder, and the environment with it installed (only it and the CPU backend loaded)."""
    root = tmp_path_factory.mktemp("guide")
    folder = root / "xinfer-community"
    for name, text in guide_files().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(folder)],
        cwd=root, check=True,
    )  # fmt: skip
    pythonpath = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    return folder, {**os.environ, "PYTHONPATH": pythonpath, "XINFER_PLUGINS": "community,cpu"}


def run(code: str, env: dict[str, str], *args: str, cwd: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_guide_shows_every_file_of_its_plugin():
    files = guide_files()
    assert {"pyproject.toml", "xinfer_community/plugin.py", "tests/test_models.py"} <= set(files)
    tree = GUIDE.read_text().split("```\nxinfer-community/\n", 1)[1].split("```", 1)[0]
    for name in files:
        assert Path(name).name in tree, f"{name} is missing from the guide's file tree"


GENERATE = """
import json, sys
from xinfer import LLM, SamplingParams
from xinfer.registry import plugins
llm = LLM(model=sys.argv[1], dtype="float32", num_blocks=32)
out = llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
packages = sorted({m.split(".")[0] for m in sys.modules if m.startswith("xinfer_")})
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "packages": packages,
                  "plugins": sorted(p.name for p in plugins())}))
"""


@pytest.mark.parametrize(
    "config, model_type, architecture",
    [
        (HeliumConfig(**TINY, architectures=["HeliumForCausalLM"]), "helium", "HeliumForCausalLM"),
        (ArceeConfig(**TINY, architectures=["ArceeForCausalLM"]), "arcee", "ArceeForCausalLM"),
        (ArceeConfig(**TINY, architectures=["ArceeForCausalLM"]), "acme", "AcmeForCausalLM"),
    ],
    ids=["helium", "arcee", "acme"],
)  # fmt: skip
def test_the_guides_architectures_give_transformers_greedy_tokens(plugin, tmp_path, config, model_type, architecture):
    folder, env = plugin
    hf = save_tiny_model(config, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.update(model_type=model_type, architectures=[architecture])  # acme: a model_type transformers lacks
    (tmp_path / "config.json").write_text(json.dumps(saved))

    tokens = prompt(20)
    got = run(GENERATE, env, str(tmp_path), json.dumps(tokens), cwd=folder.parent)
    expected = hf.generate(torch.tensor([tokens]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert got["tokens"] == expected[0, len(tokens) :].tolist()
    assert got["plugins"] == ["community", "cpu"]
    assert got["packages"] == ["xinfer_community", "xinfer_cpu"], "the guide's plugin imported another plugin"


def test_the_guides_own_tests_pass(plugin):
    folder, env = plugin
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=folder, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 passed" in result.stdout


OP = """
import json
import torch
from transformers.activations import ACT2FN
from xinfer import ops
from xinfer_cpu.ops import CpuOps
from xinfer_cuda.ops import CudaOps

generator = torch.Generator().manual_seed(0)
results = {}
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(7, 3000, generator=generator).to(dtype)
    expected = ACT2FN["relu2"](x)
    for backend in (CpuOps(), CudaOps()):
        with ops.use(backend):
            function, got = ops.get("relu2"), ops.call("relu2", x)
        # exact, but for the kernel in bf16: within one rounding step (Triton's interpreter rounds toward zero)
        rtol = 2**-7 if backend.name == "cuda" and dtype == torch.bfloat16 else 0
        results[f"{backend.name} {dtype}"] = [function.__module__, torch.allclose(got, expected, rtol=rtol, atol=0)]
print(json.dumps(results))
"""


def test_the_guides_op_runs_its_reference_on_the_cpu_and_its_triton_kernel_on_cuda(plugin):
    pytest.importorskip("triton", reason="the CUDA backend's kernels need Triton")
    folder, env = plugin
    # CudaOps only picks the kernel; under Triton's interpreter the kernel runs on CPU tensors
    got = run(OP, {**env, "TRITON_INTERPRET": "1", "XINFER_PLUGINS": "community"}, cwd=folder.parent)
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert got[f"cpu {dtype}"] == ["xinfer_community.ops", True]
        assert got[f"cuda {dtype}"] == ["xinfer_community.triton_relu2", True]


GGUF = """
import json, sys
import torch
from transformers import ArceeConfig
from xinfer.loading.gguf import gguf_adapter

config = ArceeConfig(**json.loads(sys.argv[1]))
adapter = gguf_adapter("arcee")
torch.manual_seed(0)
head_dim = config.head_dim


def llama_cpp_permute(weights, n_head):  # convert_hf_to_gguf.py, LlamaModel.permute
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


checks = {}
for name, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
    hf = torch.randn(heads * head_dim, config.hidden_size)
    hf_name = f"model.layers.0.self_attn.{name}.weight"
    checks[name] = torch.equal(adapter.undo_conversion(hf_name, llama_cpp_permute(hf, heads), config), hf)
up = torch.randn(config.intermediate_size, config.hidden_size)
checks["up_proj"] = torch.equal(adapter.undo_conversion("model.layers.0.mlp.up_proj.weight", up, config), up)
print(json.dumps({"model_type": adapter.model_type, "checks": checks}))
"""


def test_the_guides_gguf_adapter_undoes_llama_cpps_permutation(plugin):
    folder, env = plugin
    got = run(GGUF, env, json.dumps(TINY), cwd=folder.parent)
    assert got == {"model_type": "arcee", "checks": {"q_proj": True, "k_proj": True, "up_proj": True}}


def hook_table() -> dict[str, tuple[str, str]]:
    """docs/architecture.md's hooks: each one's return annotation and example."""
    return {name: (returns, example) for name, returns, example in HOOK_ROW.findall(ARCHITECTURE.read_text())}


def test_the_hook_table_gives_every_hook_with_its_signature():
    specs = {name: inspect.signature(function) for name, function in vars(hooks).items()
             if hasattr(function, f"{hooks.PROJECT}_spec")}  # fmt: skip
    assert {name: f"() -> {returns}" for name, (returns, _) in hook_table().items()} == {
        name: f"{signature}".replace("'", "") for name, signature in specs.items()
    }


HOOK_EXAMPLES = """
import importlib.util, json, re, sys
from xinfer.hooks import BackendSpec, OpSpec
from xinfer.registry import discover, load_object

manager = discover().manager  # every installed plugin, the guide's among them
NO_REFS = {"xinfer_transformers_releases"}  # its values are release numbers
found = {}
for hook, example in json.loads(sys.argv[1]).items():
    registered = [entry for answer in getattr(manager.hook, hook)() for entry in
                  (answer.items() if isinstance(answer, dict) else answer)]
    value = eval(example, {"BackendSpec": BackendSpec, "OpSpec": OpSpec})
    refs = re.findall(r'"([\\w.]+:[\\w.]+)"', example)
    if importlib.util.find_spec("triton") is None:  # the CUDA kernel's module imports Triton
        refs = [ref for ref in refs if "triton" not in ref]
    found[hook] = {"registered": all(entry in registered for entry in (value.items() if isinstance(value, dict)
                                                                       else value)),
                   "loads": all(load_object(ref) is not None for ref in refs) and (bool(refs) or hook in NO_REFS)}
print(json.dumps(found))
"""


def test_each_example_of_the_hook_table_is_registered_by_an_installed_plugin_and_loads(plugin):
    folder, env = plugin
    examples = {name: example for name, (_, example) in hook_table().items()}
    got = run(HOOK_EXAMPLES, env, json.dumps(examples), cwd=folder.parent)
    assert got == {name: {"registered": True, "loads": True} for name in examples}


KV_FORMAT = """
import json, sys
from xinfer import LLM, SamplingParams
from xinfer.kv import formats
from xinfer.server.args import build_parser

llm = LLM(model=sys.argv[1], dtype="float32", num_blocks=32, kv_cache_dtype="turbo8-v8")
out = llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
choice = out[0].outputs[0]
choices = next(a.choices for a in build_parser()._actions if "--kvcache-dtype" in a.option_strings)
print(json.dumps({"tokens": choice.token_ids, "logprobs": [entry[t] for t, entry in zip(choice.token_ids, choice.logprobs)],
                  "formats": sorted(formats()), "cli": "turbo8-v8" in choices}))
"""


def test_the_guides_kv_format_is_listed_and_decodes_close_to_transformers(plugin, tmp_path):
    """Its tokens' log-probabilities against transformers' over the same tokens: close (8-bit codes: 7e-4 measured),
    yet further than float rounding (the auto cache: 2e-7), so the cache is really stored in the format."""
    folder, env = plugin
    hf = save_tiny_model(HeliumConfig(**TINY, architectures=["HeliumForCausalLM"]), tmp_path)
    tokens = prompt(20)
    got = run(KV_FORMAT, env, str(tmp_path), json.dumps(tokens), cwd=folder.parent)
    assert "turbo8-v8" in got["formats"] and got["cli"]
    with torch.no_grad():
        logits = hf(torch.tensor([tokens + got["tokens"]])).logits[0, len(tokens) - 1 : -1]
    expected = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(got["tokens"])[:, None])[:, 0]
    error = (torch.tensor(got["logprobs"], dtype=torch.float64) - expected).abs().max().item()
    assert 1e-5 < error < 1e-2, error
