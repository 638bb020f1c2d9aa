"""Detectors: functions of the heartbeat stream that say which things are faulty and which are healthy.

A rule's `when: {detector: NAME, ...params}` names one; the registry (healer.core.detectors.registry)
maps names to classes and imports them on first use.
"""
