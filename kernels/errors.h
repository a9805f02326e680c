// How the torch bindings fail: a bad argument raises ValueError in Python, a failed CUDA or
// cuBLASLt call RuntimeError, and the process lives on. Every function the module exports is
// bound through `guarded<&fn>`, and the bindings check their inputs with SL_CHECK_ARG, not
// TORCH_CHECK.
//
// Why our own wrapper rather than TORCH_CHECK and pybind11's translators: a bad argument is a
// ValueError in Python (TORCH_CHECK gives RuntimeError), and the error never travels through
// another module's exception translators. (The old crash on failed checks was not this: it was a
// second, static libstdc++ in the module; see docs/kernels.md, "Errors from the extension".)
#pragma once

#include <Python.h>

#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <pybind11/pybind11.h>

namespace sparse_llm_glue {

// A bad argument (dtype, shape, device, layout, alignment, range): ValueError in Python.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A failed CUDA runtime or library call: RuntimeError in Python.
class KernelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

// torch's Python exception class `name` (e.g. OutOfMemoryError), else `fallback`. Borrowed: the
// torch module keeps its classes alive.
inline PyObject* torch_exception(const char* name, PyObject* fallback) {
  PyObject* torch = PyImport_ImportModule("torch");  // imported already: a lookup in sys.modules
  PyObject* type = torch != nullptr ? PyObject_GetAttrString(torch, name) : nullptr;
  Py_XDECREF(torch);
  if (type == nullptr || !PyExceptionClass_Check(type)) {
    Py_XDECREF(type);
    PyErr_Clear();
    return fallback;
  }
  Py_DECREF(type);
  return type;
}

// Called in a catch block: sets the Python exception matching the one in flight and leaves by
// error_already_set. ATen's errors (e.g. an allocation in an op) keep the classes torch gives them.
[[noreturn]] inline void raise_in_python() {
  PyObject* type = PyExc_RuntimeError;
  std::string message;
  try {
    throw;
  } catch (const pybind11::error_already_set&) {
    throw;  // a Python error already (from a cast): pybind11 restores it
  } catch (const ArgumentError& e) {
    type = PyExc_ValueError;
    message = e.what();
  } catch (const c10::OutOfMemoryError& e) {
    type = torch_exception("OutOfMemoryError", PyExc_RuntimeError);
    message = e.what_without_backtrace();
  } catch (const c10::ValueError& e) {
    type = PyExc_ValueError;
    message = e.what_without_backtrace();
  } catch (const c10::TypeError& e) {
    type = PyExc_TypeError;
    message = e.what_without_backtrace();
  } catch (const c10::IndexError& e) {
    type = PyExc_IndexError;
    message = e.what_without_backtrace();
  } catch (const c10::NotImplementedError& e) {
    type = PyExc_NotImplementedError;
    message = e.what_without_backtrace();
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  } catch (const std::bad_alloc&) {
    type = PyExc_MemoryError;
    message = "out of host memory";
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "unknown C++ exception in the sparse_llm extension";
  }
  PyErr_SetString(type, message.c_str());
  throw pybind11::error_already_set();
}

template <auto Fn>
struct Guarded;

template <typename R, typename... Args, R (*Fn)(Args...)>
struct Guarded<Fn> {
  static R call(Args... args) {
    try {
      return Fn(std::forward<Args>(args)...);
    } catch (...) {
      raise_in_python();
    }
  }
};

}  // namespace detail

// `fn` with the same signature, its exceptions raised in Python as above: m.def("f", guarded<&f>).
template <auto Fn>
inline constexpr auto guarded = &detail::Guarded<Fn>::call;

}  // namespace sparse_llm_glue

// Throws ArgumentError (ValueError in Python) with the message c10::str(...) unless `cond`.
#define SL_CHECK_ARG(cond, ...)                                                     \
  do {                                                                              \
    if (C10_UNLIKELY(!(cond))) {                                                    \
      throw ::sparse_llm_glue::ArgumentError(std::string(::c10::str(__VA_ARGS__))); \
    }                                                                               \
  } while (false)
