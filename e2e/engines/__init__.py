"""Engine stand-ins and the loader of the engines' released code (tests and the local cluster only)."""
