"""Hugging Face transformers: prefetch every distributed ``from_pretrained`` through spanwarm.

    import spanwarm.integrations.transformers as spanwarm_tf

    spanwarm_tf.enable()  # or: with spanwarm_tf.prefetch(): ...
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=4)
    )

Each rank requests exactly the bytes transformers will read for its shards (conversions
such as per-expert checkpoints stacked into packed experts included) before the first
read, and each read waits only for its own tensor.
"""

from spanwarm.integrations.transformers.loading import (
    LoadRecord,
    Prefetch,
    disable,
    enable,
    prefetch,
)

__all__ = ["LoadRecord", "Prefetch", "disable", "enable", "prefetch"]
