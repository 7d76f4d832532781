"""qkv.analysis (SPEC F1-F3): calculators from a ModelConfig, checked against measurement in tests/analysis.

    params.breakdown(cfg)                      parameters per component (exact: equals the built model)
    flops.forward(cfg, batch=, seq=) / table   FLOPs per component, forward, backward (2x), training (3x)
    memory.training(cfg, Setup(...))           bytes per GPU: weights, gradients, master, optimizer, activations
    memory.kv_cache(cfg, batch=, seq=)         inference K/V bytes
    flops.mfu(cfg, seq=, tokens_per_s=, peak_flops=)
    scaling.fit_power_law(x, y), scaling.chinchilla(flops)
    plots.* / attention_html.write             figures; record.attention_maps (a recording kernel)
    commands.add_parsers / COMMANDS            `qkv calc | plot | scaling | verify`
"""
