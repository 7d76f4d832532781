"""What wraps a finished model from outside for training (STYLE.md 6: model code knows one device): the
distributed layouts on torch.distributed (data parallel, ZeRO / FSDP2, tensor and sequence parallel, pipeline
stages; launched with torchrun), activation checkpointing and mixed-precision autocast.

    layout     processes x layout: check_layout, wrap (DDP / FSDP2 / TP / PP), the gathered state dicts
    tensor     tensor + sequence parallel plans (note 000 LLM §7.2)
    pipeline   pipeline stages with micro-batches (GPipe, 1F1B) and their checkpoints
    stages     each rank's share of the model in a pipeline
    experts    expert parallel: each MoE layer's experts split over ranks, tokens sent by all-to-all
    memory     activation checkpointing (note 000 LLM §6.2) and the bytes of a rank's state
    precision  bf16 / fp16 autocast (note 000 LLM §6.2)

Nothing here imports the training loop (qkv.train): the loop imports these.
"""
