"""Capacity planner: hardware catalog, cost model, discrete-event simulator, placement search.

catalog.py + hardware.yaml (devices) -> models.py (model shapes: model_shape.py, model_presets.py,
model_config.py) -> parallel.py (tensor or expert parallelism per worker) -> cost_model.py (step times:
roofline, or fitted by calibrate.py) -> simulator.py (the cluster, event by event; its parts, router
and workers, in sim_*.py) -> plan.py (a plan as a cluster to simulate) -> search.py (goodput by
simulation, ranking) -> report.py (table, Pareto plot, cluster.yaml). cli.py is `pdcluster plan`;
docs/planner.md describes it all.
"""

from planner.catalog import Hardware, load_catalog
from planner.cost_model import FittedCostModel, RooflineCostModel, cost_model_for
from planner.models import ModelShape, model_shape
from planner.plan import Plan, PlanContext, Pool, build_cluster
from planner.search import Evaluation, Searcher, SearchSpace, SLOTarget
from planner.simulator import ClusterSpec, SimResult, Simulator, WorkerSpec

__all__ = ["ClusterSpec", "Evaluation", "FittedCostModel", "Hardware", "ModelShape", "Plan", "PlanContext", "Pool",
           "RooflineCostModel", "SLOTarget", "SearchSpace", "Searcher", "SimResult", "Simulator", "WorkerSpec",
           "build_cluster", "cost_model_for", "load_catalog", "model_shape"]
