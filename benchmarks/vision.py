"""Qwen3-VL on dummy weights: time to first token for one image plus text, the vision encoder's
time alone, and output tokens/s for concurrent requests each with its own image. One JSON line.

    python benchmarks/vision.py [--shape qwen3-vl-8b] [--image-size 1024] [--text-len 64]
                                [--requests 64] [--output-len 128]
    python benchmarks/vision.py --smoke   # checks the script on the CPU (a tiny Qwen3-VL shape, fp32)

Every prompt has its own image (random pixels) and its own text, so no run reads another's
encoder cache or prefix cache. A 1024x1024 image is 64x64 patches of 16: 4,096 patches through
the encoder, 1,024 tokens in the language model. TTFT is ``generate`` of one token, from the PIL
image to the token (preprocessing, encoder, prefill), the median of ``--repeats`` runs after a
warm-up; ``preprocess_ms`` (the image to patches, on the host) and ``encoder_ms`` (patches to
embeddings, synchronized) are parts of it, timed alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from PIL import Image
from shapes import shape_folder

from xinfer import LLM, SamplingParams, ops


def random_image(size: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


class Prompts:
    """Fresh prompts: text around one image placeholder, as the chat template writes it."""

    def __init__(self, llm: LLM, image_size: int, text_len: int):
        config = llm.engine.hf_config.multimodal_config
        self.marks = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
        self.vocab = min(config.vision_start_token_id, llm.engine.hf_config.vocab_size)
        self.image_size, self.text_len = image_size, text_len
        self.seed = 0

    def __call__(self) -> dict[str, Any]:
        self.seed += 1
        rng = np.random.default_rng(self.seed)
        before = rng.integers(0, self.vocab, self.text_len // 2).tolist()
        after = rng.integers(0, self.vocab, self.text_len - self.text_len // 2).tolist()
        return {"prompt_token_ids": before + self.marks + after,
                "multi_modal_data": {"image": random_image(self.image_size, self.seed)}}  # fmt: skip


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 2)


def encoder_times(llm: LLM, prompts: Prompts, repeats: int) -> dict[str, Any]:
    engine = llm.engine
    processor = engine.mm_processor
    assert processor is not None
    image = prompts()["multi_modal_data"]["image"]
    item = processor.process("image", image)

    def encode() -> None:
        with torch.inference_mode(), ops.use(engine.ops):
            engine.model.encode("image", [item])
        synchronize(engine.device)

    encode()  # warm-up
    return {
        "image_tokens": item.num_embeddings,
        "patches": int(item.data["patches"].shape[0]),
        "preprocess_ms": median_ms(lambda: processor.process("image", image), repeats),
        "encoder_ms": median_ms(encode, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-vl-8b")
    parser.add_argument("--image-size", type=int, default=1024, help="side of the square test images, in pixels")
    parser.add_argument("--text-len", type=int, default=64, help="text tokens per prompt, around the image")
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests of the throughput run")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each throughput request generates")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument(
        "--smoke", action="store_true", help="check this script on the CPU: a tiny Qwen3-VL shape, fp32, small runs"
    )
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.image_size, args.requests, args.output_len, args.repeats = "qwen3-vl-tiny", 64, 4, 8, 2
    dtype, device = ("float32", "cpu") if args.smoke else ("bfloat16", "auto")
    llm = LLM(model=shape_folder(args.shape, tokenizer=True), load_format="dummy", dtype=dtype, device=device,
              max_model_len=args.max_model_len, max_num_seqs=max(args.requests, 1))  # fmt: skip
    prompts = Prompts(llm, args.image_size, args.text_len)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prompts() for _ in range(2)], first)  # warm-up: kernels, recorded steps
    result: dict[str, Any] = {
        "shape": args.shape,
        "device": str(llm.engine.device),
        "dtype": dtype,
        "image_size": args.image_size,
        "text_len": args.text_len,
        **encoder_times(llm, prompts, args.repeats),
        "ttft_ms": median_ms(lambda: llm.generate([prompts()], first), args.repeats),
    }
    batch = [prompts() for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    first_token_at = None
    for _ in llm.stream(batch, params):
        first_token_at = first_token_at or time.perf_counter()
    elapsed = time.perf_counter() - start
    result.update(
        requests=args.requests,
        output_len=args.output_len,
        output_tok_s=round(args.requests * args.output_len / elapsed, 2),
        seconds=round(elapsed, 3),
        first_token_s=round((first_token_at or start) - start, 3),
        encoder_cache_hits=llm.engine.encoder_cache.hits,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
