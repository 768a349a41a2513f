"""Images on dummy weights: time to first token of one image plus text, the encoder alone, and output
tokens per second of many concurrent requests with an image each.

    python benchmarks/vision.py --shape gemma3-4b-vision --image-size 1024 --text-tokens 64 --concurrency 64
    python benchmarks/vision.py --shape qwen3-vl-8b --image-size 1024 --text-tokens 64 --concurrency 64
    python benchmarks/vision.py --smoke   # checks the script on the CPU (a tiny Qwen3-VL shape, fp32)
    python benchmarks/vision.py --shape qwen3-vl-8b --count-launches   # kernels per encoder forward / prefill

Qwen3-VL resizes a 1024x1024 image to 64x64 patches of 16 (4,096 through the encoder) and
1,024 language-model tokens; Gemma 3 resizes every image to 896x896, 256 tokens.
``preprocess_ms`` is the host's part (the image to the encoder's input), inside the TTFT.

Prints one JSON line. Each request's image is its own (a repeated one would hit the encoder cache);
the encoder-cache check at the end sends the first image again and reports the hits."""

from __future__ import annotations

import argparse
import json
import time

import torch
from PIL import Image
from profiling import count_launches
from shapes import shape_folder

from xinfer import LLM, SamplingParams, ops


def synthetic_image(size: int, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    pixels = torch.stack([x, y, (x * y)]) * 180 + torch.rand(3, size, size, generator=generator) * 75
    return Image.fromarray(pixels.byte().permute(1, 2, 0).numpy(), "RGB")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gemma3-4b-vision")
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--count-launches", action="store_true",
                        help="report the kernels one encoder forward and one prefill step with an image launch, then exit")  # fmt: skip
    parser.add_argument("--smoke", action="store_true",
                        help="check this script on the CPU: a tiny Qwen3-VL shape, fp32, small images, few requests")  # fmt: skip
    args = parser.parse_args()
    device = "auto"
    if args.smoke:
        args.shape, args.dtype, device = "qwen3-vl-tiny", "float32", "cpu"
        args.image_size, args.output_tokens, args.concurrency = 64, 8, 4

    llm = LLM(model=shape_folder(args.shape), load_format="dummy", dtype=args.dtype, device=device,
              max_model_len=args.max_model_len, max_num_seqs=max(args.concurrency, 1))  # fmt: skip
    engine = llm.engine
    assert engine.mm_processor is not None, f"{args.shape} takes no images"
    boi = engine.mm_processor.placeholders["image"]
    vocab = min(1000, engine.hf_config.vocab_size)
    text = torch.randint(10, vocab, (args.text_tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def request(seed: int) -> dict:
        return {
            "prompt_token_ids": [2, *text, boi],
            "multi_modal_data": {"image": synthetic_image(args.image_size, seed)},
        }

    first = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(request(-1), first)  # warm-up
    image = synthetic_image(args.image_size, -2)
    start = time.perf_counter()
    item = engine.mm_processor.process("image", image)
    preprocess_s = time.perf_counter() - start
    with torch.inference_mode(), ops.use(engine.ops):
        engine.model.encode("image", [item])
        sync()
        start = time.perf_counter()
        engine.model.encode("image", [item])
        sync()
        encoder_s = time.perf_counter() - start
        if args.count_launches:
            encoder = count_launches(lambda: engine.model.encode("image", [item]))
    if args.count_launches:  # the prefill of one request (its image encoded inside), then one sampled token
        prefill = count_launches(lambda: llm.generate(request(2000), first))
        print(json.dumps({"shape": args.shape, "image": args.image_size, "image_tokens": item.num_embeddings,
                          "encoder": encoder, "prefill_step": prefill}))  # fmt: skip
        return

    ttft = []
    for seed in range(3):
        prompt = request(1000 + seed)  # preprocessing is the client's part, not timed
        start = time.perf_counter()
        llm.generate(prompt, first)
        ttft.append(time.perf_counter() - start)

    prompts = [request(seed) for seed in range(args.concurrency)]
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)

    hits = engine.encoder_cache.hits
    llm.generate(prompts[0], first)
    print(json.dumps({
        "shape": args.shape, "image": args.image_size, "text_tokens": args.text_tokens,
        "image_tokens": item.num_embeddings, "preprocess_ms": round(preprocess_s * 1e3, 2),
        "encoder_ms": round(encoder_s * 1e3, 2),
        "ttft_ms": round(min(ttft) * 1e3, 2), "concurrency": args.concurrency,
        "output_tok_s": round(generated / elapsed, 1), "total_s": round(elapsed, 2),
        "encoder_cache_hit_on_repeat": engine.encoder_cache.hits - hits,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
