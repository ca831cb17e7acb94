"""The report's sections. Each section is one function: data prep in pandas
(a separate, unit-tested function) → tables and figures. A section returns no blocks when its
data is absent, and is then left out of the page.

Adding a section for a new workload takes a few lines in a module of this package, and the
module's name in `registry.PAGE_ORDER` (where on the page it goes):

    @section("my-workload", "My workload", "what it shows")
    def my_workload(data: ReportData) -> list[Block]:
        df = my_prep(data.workload("my_workload"))
        if df.empty:
            return []
        return [Figure(facet_lines(df, ...), "my-figure", table=values_table(df, ...))]
"""
