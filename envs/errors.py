"""Named exceptions of the world model. Each says what is wrong and where."""


class RlplaceError(ValueError):
    """Base class: bad input to rlplace (the CLI maps it to exit code 2)."""


class GraphError(RlplaceError):
    """An OpGraph is malformed (cycle, dangling edge, duplicate name, bad cost)."""


class TopologyError(RlplaceError):
    """A Topology is malformed (unknown device, bad bandwidth, unreachable device)."""


class PlanError(RlplaceError):
    """A Plan does not fit its graph or topology."""


class EnvError(RlplaceError):
    """An environment cannot be built for its tasks (graph too large, too many devices, no plan fits)."""
