"""Hugging Face interop: the generic engine (safetensors files, config.json, the weight
mapping driven by a family's tensor table, whole-directory conversion) and the adapters the
families declare (adapter.py: the contract and @adapter; llama.py, mixtral.py: the bundled
ones, registered by families.py, which every lookup goes through). Importing the package
imports nothing (a module importing shardlab.hf.adapter must not close a cycle)."""
