"""The run report's former single module, kept so that `from ddpo_group.report.inspect import ...` goes on working.

The report lives in the package ddpo_group/report/ (run.py reads a run directory, markup.py, figures.py,
tables.py, compare.py and page.py build the page); new code imports from there.
"""

from ddpo_group.report.figures import (  # noqa: F401
    STEP_LABELS,
    evaluation_figure,
    plot_curves,
    plot_evaluation,
    plot_step_heatmaps,
    plot_times,
    step_keys,
)
from ddpo_group.report.markup import MAX_REPORT_BYTES, Inline, shown_width  # noqa: F401
from ddpo_group.report.page import build_report, thin_evenly, write_report, write_step_heatmaps  # noqa: F401
from ddpo_group.report.run import (  # noqa: F401
    RunData,
    SampleSource,
    load_run,
    metric_series,
    read_eval_records,
    read_metrics,
    read_sample_records,
    sample_source,
    step_matrix,
    trained_epochs,
    wall_time,
)
from ddpo_group.report.tables import choose_prompts, duration, headline, run_status  # noqa: F401
