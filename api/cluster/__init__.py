"""`vlmserve cluster`: serve replicas behind HAProxy, routed by image (launcher, balancer config, routing)."""

from api.cluster.haproxy import AdminSocket, BalancerConfig, ServerState, find_haproxy
from api.cluster.launcher import Cluster, ClusterError, ClusterSpec, run_cluster

__all__ = [
    "AdminSocket",
    "BalancerConfig",
    "Cluster",
    "ClusterError",
    "ClusterSpec",
    "ServerState",
    "find_haproxy",
    "run_cluster",
]
