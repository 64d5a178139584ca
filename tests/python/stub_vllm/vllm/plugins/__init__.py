"""STUB: general plugins are entry points of the group vllm.general_plugins, loaded once per
process and called (the pinned vllm/plugins/__init__.py)."""
DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
plugins_loaded = False


def load_general_plugins():
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    from importlib.metadata import entry_points
    eps = entry_points()
    group = (eps.select(group=DEFAULT_PLUGINS_GROUP) if hasattr(eps, "select")
             else eps.get(DEFAULT_PLUGINS_GROUP, ()))
    for ep in group:
        ep.load()()
