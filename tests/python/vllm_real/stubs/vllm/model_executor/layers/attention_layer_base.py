"""STUB vllm.model_executor.layers.attention_layer_base: the marker base class only (the real
one declares the attention layers' abstract interface)."""


class AttentionLayerBase:
    pass
