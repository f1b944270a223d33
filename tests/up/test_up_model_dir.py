"""`wavepp up --model DIR --stages S` with real processes: a Hugging Face checkpoint directory
served with no config file, its layers split by cost, its tokenizer.json for text prompts."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from up_support import build_tokenizer, start_up, stop_up

pytest.importorskip("transformers")
from wavepp.bench.checkpoints import save_random_checkpoint  # noqa: E402
from wavepp.runtime.hf_config import load_model_dir  # noqa: E402
from wavepp.runtime.stage.engine.balance import checkpoint_partition  # noqa: E402

pytestmark = pytest.mark.timeout(240)


async def post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, dict]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


async def test_up_serves_a_checkpoint_directory_with_its_tokenizer(tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny-dsv3"
    save_random_checkpoint("deepseek_v3", ckpt, num_layers=4, vocab_size=256)
    build_tokenizer(ckpt)  # words w0..w198 -> ids 1..199, inside the model's 256
    service = start_up(tmp_path / "up", None, ["--model", str(ckpt), "--stages", "2"])
    try:
        serving_line = next(line for line in service.lines if "wavepp up: serving" in line)
        assert f"from {ckpt}, tokenizer {ckpt}" in serving_line
        config = json.loads((service.state_dir / "default-r0.json").read_text())
        assert (config["model_dir"], config["weights"]) == (str(ckpt), None)
        assert config["model"]["architecture"] == "deepseek_v3"
        assert config["partition"] == checkpoint_partition(ckpt, 2)
        name = load_model_dir(ckpt).name
        text = " ".join(f"w{i}" for i in range(1, 41))  # 40 tokens: 2 full blocks of 16
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{service.endpoint}/v1/models") as response:
                assert (await response.json())["data"][0]["id"] == name
            completions = []
            for _ in range(2):
                status, body = await post(
                    session, f"{service.endpoint}/v1/completions", {"model": name, "prompt": text}
                )
                assert status == 200, body
                completions.append(body)
            # the same prompt as the tokenizer's ids, through /v1/prefill
            status, prefill = await post(
                session,
                f"{service.endpoint}/v1/prefill",
                {"tenant": "default", "token_ids": list(range(2, 42))},
            )
        assert status == 200, prefill
        first, again = completions
        print(
            "cached tokens:",
            [c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in completions],
            prefill["num_cached_tokens"],
        )
        assert [c["usage"]["prompt_tokens"] for c in completions] == [40, 40]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        # the text was tokenized by the checkpoint's tokenizer: the ids hit the same blocks
        assert prefill["num_prompt_tokens"] == 40 and prefill["num_cached_tokens"] == 32
        token = first["choices"][0]["token_ids"][0]
        assert again["choices"][0]["token_ids"][0] == prefill["first_token_id"] == token
    finally:
        assert stop_up(service.proc) == 0, "".join(service.lines[-40:])
