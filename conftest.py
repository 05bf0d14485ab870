"""Repository-wide pytest set-up: the Kubernetes control-plane fixtures are a plugin
loaded once here, so every folder that needs them shares one control plane."""

pytest_plugins = ["e2e.fixtures"]
