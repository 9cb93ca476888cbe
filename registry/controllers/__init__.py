"""Litestar controllers of the registry, one per domain, all under /internal with the admin guard."""

from registry.controllers.adapters import AdapterController
from registry.controllers.aliases import AliasController
from registry.controllers.audit import AuditController
from registry.controllers.replicas import PlacementController, ReplicaController
from registry.controllers.rollouts import RolloutController
from registry.controllers.routing import RoutingController, StatsController
from registry.controllers.tenants import AuthController, TenantController
from registry.controllers.workers import CriticalModelController, WorkerController

CONTROLLERS = [
    TenantController,
    AuthController,
    AdapterController,
    AliasController,
    RolloutController,
    ReplicaController,
    PlacementController,
    StatsController,
    RoutingController,
    WorkerController,
    CriticalModelController,
    AuditController,
]
