"""How a layer's network runs: plans and the executor, its GEMMs, lookups, chains and the
opaque ops layers trace as. Knows nothing of modules (:mod:`..layers` holds those)."""
from .executor import contract, generated_code, generated_code_dump, thin_pair
from .plans import ContractionPlan, LookupPlan, Step, bucket_of, get_planner

__all__ = ["contract", "thin_pair", "generated_code", "generated_code_dump", "ContractionPlan", "LookupPlan", "Step",
           "bucket_of", "get_planner"]
