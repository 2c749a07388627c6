"""What a command says: its verdicts and report as typed values, its expected errors, and how they print.

    verdicts  Verdict, Outcome, PatchReport, Report: what the engine decides
    errors    expected failures, each with what failed, why and the command to run next; the exit statuses
    render    reports for people (text), machines (JSON, described by report.schema.json at the package's top)
              and pull requests or issues (Markdown)
    progress  progress bars for long work on a terminal (rich, imported there only): drift's and anchors
              record's wheel fetches

May import: nothing of the package; everything else stands on it.
"""
