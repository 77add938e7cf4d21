/* gpt2attn/export.h: GPT2ATTN_API marks every declaration libgpt2attn.so exports. The library is compiled with
 * -fvisibility=hidden -fvisibility-inlines-hidden, so whatever is not marked (the engine, the kernels, the file
 * readers, and the oneDNN, xsimd and JSON code inlined into them) stays inside it; tests/c/check_exports.cmake
 * checks the result with nm. Plain C preprocessor, so that the C header can include it.
 *
 * GPT2ATTN_LOCAL keeps a nested class of an exported class inside the library: GCC gives nested classes their
 * enclosing class's visibility, which would export every member of the engine's Impl structs. */
#ifndef GPT2ATTN_EXPORT_H
#define GPT2ATTN_EXPORT_H

#if defined(__GNUC__) || defined(__clang__)
#define GPT2ATTN_API __attribute__((visibility("default")))
#define GPT2ATTN_LOCAL __attribute__((visibility("hidden")))
#else
#define GPT2ATTN_API
#define GPT2ATTN_LOCAL
#endif

#endif /* GPT2ATTN_EXPORT_H */
