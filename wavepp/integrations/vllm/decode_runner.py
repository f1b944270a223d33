"""A vLLM decode engine driven over stdin/stdout: run in vLLM's environment as
``python -m wavepp.integrations.vllm.decode_runner --model DIR [options]``.

It builds one ``vllm.LLM`` (float32, ``skip_tokenizer_init``, ``enforce_eager``, prefix caching
off so that a request without a handoff is computed in full) with ``WavePPConnector`` as a
``kv_consumer``, prints ``{"ready": true}``, then for each input line (a JSON list of requests
``{"id", "prompt": [token ids], "max_tokens", "kv_transfer_params"?}``) generates greedily and
prints one JSON line: ``[{"id", "tokens": [...], "error": ""}, ...]`` in input order. A request
with ``kv_transfer_params`` decodes from the handed-over KV; one without is vLLM's own prefill
and decode. A request with ``"logprobs": k`` (k >= 1) also gets ``"logprobs"``: per decoded
token, ``{"token id": logprob}`` of vLLM's top k and the sampled token (natural log of the
softmax of the raw logits, vLLM's ``raw_logprobs``). EOF on stdin ends it.

``--native-rope`` runs vLLM's RoPE in its PyTorch implementation (``compilation_config``
``custom_ops: ["-rotary_embedding"]``, a vLLM setting) instead of its CPU kernel: that kernel
(``ops.rotary_embedding``) reads a [tokens, heads, dim] or strided view as if it were
[tokens, heads * dim] contiguous (token stride ``stride(-2)``, heads ``size(-1) / head_size``),
and vLLM's MLA hands it exactly such views (``q[..., nope:]`` and the roped key sliced from the
fused ``q_a``/``kv_a`` output), so on CPU an MLA model's queries and prefilled roped keys are
rotated at wrong positions, or not at all (``tests/bench/test_vllm_rope.py``).

``--save-kv-dir DIR`` makes a reference engine instead: no ``WavePPConnector``; vLLM's example
connector (``ExampleConnector``, ``kv_producer``) saves the cache its own prefill wrote, one
safetensors file per layer under ``DIR/<hash of the prompt's tokens>/<layer name>`` holding
``kv_cache`` [tokens, ...] (an MLA layer: [tokens, kv_lora_rank + rope], the rows of vLLM's
cache) for the prompt's first ``(len - 1) // block * block`` tokens (what that connector stores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--stats-path", default="")
    parser.add_argument("--memory-utilization", type=float, default=0.1)
    parser.add_argument("--native-rope", action="store_true", help="vLLM's PyTorch RoPE")
    parser.add_argument("--save-kv-dir", default="", help="reference engine: save own KV here")
    args = parser.parse_args(argv)
    # The answers own stdout; whatever vLLM prints goes to stderr.
    answers_out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=False,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.memory_utilization,
        compilation_config={"custom_ops": ["-rotary_embedding"]} if args.native_rope else None,
        kv_transfer_config=(
            KVTransferConfig(
                kv_connector="ExampleConnector",
                kv_role="kv_producer",
                kv_connector_extra_config={"shared_storage_path": args.save_kv_dir},
            )
            if args.save_kv_dir
            else KVTransferConfig(
                kv_connector="WavePPConnector",
                kv_role="kv_consumer",
                kv_connector_module_path="wavepp.integrations.vllm.connector",
                kv_connector_extra_config={"stats_path": args.stats_path},
            )
        ),
    )
    print(json.dumps({"ready": True}), file=answers_out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        batch = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=list(r["prompt"])) for r in batch]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=int(r.get("max_tokens", 16)),
                ignore_eos=True,
                detokenize=False,
                logprobs=int(r["logprobs"]) if r.get("logprobs") else None,
                extra_args=(
                    {"kv_transfer_params": r["kv_transfer_params"]}
                    if r.get("kv_transfer_params")
                    else None
                ),
            )
            for r in batch
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        answers = []
        for r, result in zip(batch, outputs, strict=True):
            completion = result.outputs[0]
            error = (
                ""
                if completion.finish_reason in ("length", "stop")
                else str(completion.finish_reason)
            )
            answer = {"id": r["id"], "tokens": list(completion.token_ids), "error": error}
            if r.get("logprobs"):
                answer["logprobs"] = [
                    {str(token): float(lp.logprob) for token, lp in step.items()}
                    for step in completion.logprobs or []
                ]
            answers.append(answer)
        print(json.dumps(answers), file=answers_out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
