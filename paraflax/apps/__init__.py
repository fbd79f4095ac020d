"""Programs built on the library: `paraflax generate` (`generate`) and `paraflax demo` (`demo`)."""
