"""The names of the metrics a run logs once per layer."""


def layer_metric(name: str, layer: int, num_layers: int) -> str:
    """`<name>/layer_NN`: the index padded to at least two digits (more for 100+ layers), so one
    run's keys sort in layer order and a metric has the same keys on every preset."""
    width = max(2, len(str(num_layers - 1)))
    return f"{name}/layer_{layer:0{width}d}"
