"""The command-line tooling behind `flashtriton check | tune | bench`: the notebook's checks (`checks`), the
forward config sweep (`tune`) and the side-by-side benchmark (`bench`, with `bench_core`, `bench_measure`,
`bench_providers`, `bench_suites`, `bench_report`). The library proper never imports this package; `cli` does."""
