"""Reports: a model's self-contained HTML report and the summary across models.

``data`` loads the result files, ``tables`` derives the numbers, ``figures`` draws them (matplotlib, Agg, SVG
embedded as data URIs), ``html`` holds the building blocks and page shell, ``render`` assembles a model's report,
``summary`` the table across models; ``paper`` holds the published numbers shown beside this run's.
"""
