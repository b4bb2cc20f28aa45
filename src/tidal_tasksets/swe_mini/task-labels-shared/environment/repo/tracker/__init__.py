"""A minimal task tracker."""
