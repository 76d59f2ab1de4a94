"""rayturn: disaggregated LLM serving on Ray for agentic coding workloads."""

__version__ = "0.1.0"
