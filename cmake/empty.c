/* Placeholder so a module folder with no sources yet still configures. */
typedef int qt_empty_translation_unit;
