"""GenEval (Ghosh et al., arXiv 2310.11513): the object-focused evaluation protocol and the training reward.

Modules (docs/geneval.md says how they fit):

- ``vocabulary``: GenEval's 80 COCO class names, 10 colours, 4 relations, 6 tags.
- ``metadata``: ``evaluation_metadata.jsonl`` records (read and checked, one-line errors) and the training-prompt
  generator that follows GenEval's prompt rules, deduplicated against an evaluation set.
- ``protocol``: the rules of djghosh13/geneval ``evaluation/evaluate_images.py`` and ``summary_scores.py`` (an
  image is correct or not; the per-tag and overall table) and Flow-GRPO's partial score (yifan123/reward-server
  ``gen_eval.py``), on detections from any detector.
- ``expected``: Flow-GRPO's strict verdict averaged over the detector's scores read as probabilities (the reward
  score "expected"; uses ``protocol``'s rules, and ``reward`` hands it to the scorer).
- ``detectors``: the detector and colour-classifier interface; Mask2Former and CLIP through transformers.
- ``shapes_scenes``: several shapes-world objects in one image, and an exact detector and colour classifier
  for them, so that the protocol can be checked on images whose answer is known.
- ``reward``: the registered reward ``geneval`` (imported only by ``rewards/registry.py``).
"""
