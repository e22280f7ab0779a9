"""The run report: one self-contained HTML page for a run directory, or two side by side.

    run.py      reading a run directory (metrics.jsonl's reading rule, config, markers, sample files)
    markup.py   HTML building blocks: escaping, the stylesheet, images embedded under the size cap
    figures.py  the matplotlib figures (curves, evaluation, per-step heat maps)
    tables.py   the headline, summary and config tables; which prompts' samples are shown
    compare.py  the compare page's parts (paired evaluation images)
    page.py     the page: its sections in order, build_report / write_report / write_step_heatmaps

Entry point: `ddpo-group-inspect` / scripts/inspect_run.py (ddpo_group.cli.inspect_main).
"""
