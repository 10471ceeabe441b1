"""From the user's model and guide to a layer graph: tracing, model forms, the posterior."""
