"""Code shared by every stage: URIs, configuration, the object store and artifacts."""
