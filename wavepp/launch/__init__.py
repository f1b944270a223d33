"""The one place that turns a WavePipeline spec (a file, the custom resource's ``spec.json``)
and command-line flags into each process's configuration. The subcommands (``wavepp.cmd``)
parse flags and call it; the operator renders the same spec into pods whose processes read
it through here. ``up_run`` runs what ``wavepp up`` plans.

runtime_config  spec -> one RuntimeConfig per replica (model, checkpoint, KV capacity, device);
                the one reader of a served checkpoint (ServedCheckpoint, with_checkpoint)
replica         a stage's or admission's RuntimeConfig from its flags and environment; telemetry
gateway         the gateway's GatewayConfig from the spec and ``pool.json``, or its flags
up              what ``wavepp up`` runs (``plan_up``) and its children's command lines
up_run          ``wavepp up`` running: nats-server, children, supervision, stop (``run_up``)
replay          the replica ``wavepp replay`` runs, from its flags
sim             the settings ``wavepp sim`` simulates, from its flags
host_tier       the host KV tier's capacity and load time from host memory per GPU
grid            the runs ``wavepp bench grid`` makes, from its flags; a grid setting's config
agreement       the settings ``wavepp bench agreement`` measures, from its flags
flags           ``ArgError``, the checks of flags the pipeline processes share, one-line errors
"""
