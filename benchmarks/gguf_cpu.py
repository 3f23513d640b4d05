"""The default model (SmolLM2-135M Q4_1 GGUF) on the CPU: load time, weight memory and greedy
decode speed of tinypaged's two CPU strategies for GGUF weights, beside transformers reading
the same file (dequantized to fp32 at load, its only way on the CPU).

    cached     dequantize each quantized matrix once at load to fp32 (GGUFConfig.cpu_dequantize)
    per-call   keep the blocks and dequantize inside every matmul (the torch reference)

    PYTHONPATH=. python benchmarks/gguf_cpu.py [--steps 32] [--threads 2]
Prints one JSON line per run; each run is a fresh process, so peak RSS is its own.
"""
import argparse
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads({threads})
steps, mode = {steps}, "{mode}"
prompt = list(range(100, 132))
from tinypaged.models.default_model import ensure_default_model
model_dir = ensure_default_model()
start = time.perf_counter()
if mode == "transformers":
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from tinypaged.models.gguf_file import gguf_file_of
    path = gguf_file_of(model_dir)  # what from_pretrained(gguf_file=) does, without accelerate
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    model.eval()
    load_s = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        start = time.perf_counter()
        for _ in range(steps):
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
    decode_s = time.perf_counter() - start
else:
    from tinypaged import LLM, SamplingParams
    from tinypaged.quantization import gguf as gguf_layers
    if mode == "per-call":
        gguf_layers.GGUFConfig.from_config = classmethod(lambda cls, q: cls(cpu_dequantize=False))
    llm = LLM(device="cpu", skip_tokenizer_init=True, enable_prefix_caching=False,
              max_model_len=256, num_kv_blocks=(len(prompt) + steps) // 16 + 2)
    load_s = time.perf_counter() - start
    model = llm.engine.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():  # the tied head's dense copy appears at its first call
        weights += sum(w.numel() * w.element_size() for _, w in getattr(module, "gguf_parts", []))

    def generate(n):  # prefill + n - 1 decode steps; wall seconds
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{{"prompt_token_ids": prompt}}], params, use_tqdm=False)
        return time.perf_counter() - t

    generate(1)  # warm-up
    if mode != "per-call":
        weights += sum(w.numel() * w.element_size() for _, w in model.lm_head.gguf_parts)
    decode_s = generate(steps + 1) - generate(1)  # the prefill cancels out
decode = steps / decode_s
print(json.dumps(dict(mode=mode, threads={threads}, load_s=round(load_s, 1),
                      weights_MB=round(weights / 1e6), decode_tok_s=round(decode, 2),
                      peak_rss_MB=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3))))
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["cached", "per-call", "transformers"])
    args = parser.parse_args()
    for mode in args.modes:
        code = CHILD.format(threads=args.threads, steps=args.steps, mode=mode)
        subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    main()
