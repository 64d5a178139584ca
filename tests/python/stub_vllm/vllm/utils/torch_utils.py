"""STUB: layer names are plain strings here."""


def _resolve_layer_name(layer_name):
    return getattr(layer_name, "value", layer_name)


def _encode_layer_name(layer_name):
    return layer_name
