"""The healer's pages: incidents, one incident, one job, and the single-file run report.

One set of templates and charts for both front doors: the `megaheal healer` service serves them
(healer/service/pages.py) and `megaheal report --html` writes the same pages into one self-contained file.
Charts are SVG drawn on the server; there is no JavaScript, so the Content-Security-Policy forbids scripts.

    rundir.py     a run directory read for the pages: attempts, the nodes of each rank, per-rank step records
    views.py      what each page shows, read from the healer's database (and the run directory where known)
    cost.py       each incident's cost in lost GPU-time, from the goodput ledger
    heatmap.py    per-rank compute time around an incident, and its phase split
    waterfall.py  the goodput waterfall and the run's time line
    lossplot.py   loss and step over time, with attempts and incidents marked
    axes.py       scales, ticks and durations for the charts
    render.py     the Jinja environment, the CSP, and the pages rendered as served or as one file
    onefile.py    the single-file report of one run
    templates/    the pages (Jinja2, autoescaped) and the SVG charts; pages.css, inlined and allowed by its hash
"""
