"""Scoring a policy: `evaluator` (fixed-noise evaluation during a run and of a checkpoint), `protocols`
(GenEval / OCR / judge protocols and their tables), `protocol_report` (their report fragments), `hacking` (the
reward-hacking monitor)."""
