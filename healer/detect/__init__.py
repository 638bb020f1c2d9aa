"""Detect: functions of what the healer observes that say which things are faulty and which are healthy (one
detector a rule's `when: {detector: NAME}`), the PromQL rules, and the signals a rule turns a finding into."""
