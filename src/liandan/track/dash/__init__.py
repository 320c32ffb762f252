"""`liandan dash`: a web dashboard of a project's runs, read through the run store (api.py), served by
Starlette and uvicorn (app.py, serve.py), drawn in the browser with plotly.js from the `plotly` package
(static/). Needs the [dash] extra; nothing here is imported by training."""
