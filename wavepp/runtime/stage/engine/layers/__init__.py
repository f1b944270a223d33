"""Decoder-layer kinds of the torch engines (``engine/decoder.py``).

One module per layer kind, each a plain class holding its stage-local weights (no
``nn.Module``); its shape is a pure dataclass of ``wavepp.runtime.families.layer_plan``:

| module       | what                                                                   |
| ------------ | ---------------------------------------------------------------------- |
| ``common``   | RMSNorm, RoPE tables (rotate-half and interleaved), paged attention     |
| ``linear``   | ``PackedLinear``: a projection's weight pre-packed for its kernel       |
| ``gqa``      | grouped-query attention over a paged K/V cache (Llama, MiniMax-M2)      |
| ``mla``      | multi-head latent attention over a paged *latent* cache (DeepSeek-V3)   |
| ``dsa``      | GLM-5's sparse-attention indexer, its key cache paged beside the latent |
| ``kda``      | Kimi-Linear's KDA layer, its recurrent state stored per k blocks         |
| ``moe``      | dense SwiGLU MLP and routed + shared experts (DeepSeek, MiniMax, Kimi)  |
"""
