"""The engine: one for both front doors. It runs the stages in ticks (ingest, detect, respond, recover, notify) and
acts only through the ports (healer/ports.py) that a front door hands it."""
