"""YAML recipes: the schema, loading with inheritance and overrides, and validation."""

from setdiff_megatron.recipes.recipe_files import RecipeError, dump_recipe, load_recipe, save_resolved_recipe
from setdiff_megatron.recipes.schema import Recipe
from setdiff_megatron.recipes.validation import check_engine_installed, validate_recipe

__all__ = [
    "Recipe",
    "RecipeError",
    "load_recipe",
    "save_resolved_recipe",
    "dump_recipe",
    "validate_recipe",
    "check_engine_installed",
]
