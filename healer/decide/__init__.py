"""Decide: the fault catalogue, the rules, and the one pure policy that turns an incident's facts into a plan with
its basis. Nothing here acts; the engine carries a decision out through the ports (healer/ports.py)."""
