"""Running nebula-fl as long-lived services: a site (one cluster) or the server host, each from one config file."""
