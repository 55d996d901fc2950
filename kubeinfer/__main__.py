from kubeinfer.cli import app

app()
