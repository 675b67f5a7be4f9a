"""`make demo`: placeholder until the shipped SmolLM2 drafter lands."""

print("dspark-hf demo: not yet available (the shipped SmolLM2 drafter is still being trained).")
