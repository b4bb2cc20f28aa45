"""Package dependencies of the monorepo."""
