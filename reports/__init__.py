"""Reports rendered from one versioned ``report.json``: Markdown, self-contained HTML with plots,
JUnit XML, the multi-model compatibility matrix, and the CI gate's re-judging."""

from reports.schema import REPORT_SCHEMA_VERSION, build_report, load_report, validate_report
from reports.writer import FORMATS, write_reports

__all__ = ["FORMATS", "REPORT_SCHEMA_VERSION", "build_report", "load_report", "validate_report", "write_reports"]
