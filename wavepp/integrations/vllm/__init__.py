"""vLLM as the decode engine of a WavePP prefill pool: ``connector.WavePPConnector``, a vLLM KV
connector (``KVConnectorBase_V1``) that pulls each stage's layers of a prefilled request's KV
into vLLM's paged cache. Import the submodules; this package imports nothing."""
