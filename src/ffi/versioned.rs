//! Versioned structs from C (`mkConfig_t`, `mkMoeOptions_t`): each starts with `size`,
//! `magic` and `version`, so one library accepts the struct of any header of its major
//! version. The library reads `size` first, then only the first `size` bytes:
//! - a smaller struct (an older header): the fields it lacks keep the initializer's values;
//! - a larger struct (a newer header, at most [`MAX_BYTES`]): accepted when every field
//!   beyond this library's struct is unset (each 4-byte word unset by the struct's rule),
//!   else mkInvalidArgument names the first one set (this library cannot honour it);
//! - `size` below [`HEADER_BYTES`], a wrong `magic`, `version` 0 or of another major
//!   version than the library's: mkInvalidArgument.

use crate::error::{MkError, Result};

/// Bytes of `size`, `magic` and `version`: the part every versioned struct has.
pub const HEADER_BYTES: usize = 16;
const MAGIC_OFFSET: usize = 8;
const VERSION_OFFSET: usize = 12;
/// The largest `size` accepted from a newer header.
pub const MAX_BYTES: usize = 1024;

/// What the reader needs to know of one versioned struct, and the names its messages use.
pub struct VersionedStruct {
    /// The argument's name in messages (`config`, `options`).
    pub arg: &'static str,
    /// The C type (`mkConfig_t`).
    pub type_name: &'static str,
    /// Its initializer macro and its init function (`MK_CONFIG_INITIALIZER`, `mkConfigInit`).
    pub initializer: &'static str,
    pub init_fn: &'static str,
    pub magic: u32,
    /// (offset, bytes) of every field after `size`, in order.
    pub fields: &'static [(usize, usize)],
    /// Whether a 4-byte word of a newer header's field counts as unset.
    pub unset_word: fn(u32) -> bool,
}

impl VersionedStruct {
    /// Reads a caller's struct of any version into `initializer` (this library's unset
    /// values): `size` first, then whole fields within `size`. The caller's struct is only
    /// ever copied byte by byte, so a short struct at the end of a mapping and a misaligned
    /// one are both fine.
    ///
    /// # Safety
    /// `ptr` must be non-NULL and point to at least `ptr->size` readable bytes; `T` must be
    /// a plain repr(C) struct (every bit pattern valid) starting with `size: usize`,
    /// `magic: u32` and `version: u32`, whose fields after `size` are `self.fields`.
    pub unsafe fn read<T: Copy>(&self, ptr: *const T, initializer: T) -> Result<T> {
        let (arg, type_name, init, init_fn) = (self.arg, self.type_name, self.initializer, self.init_fn);
        let bytes = ptr.cast::<u8>();
        let size = std::ptr::read_unaligned(ptr.cast::<usize>());
        if size < HEADER_BYTES {
            return Err(MkError::invalid_argument(format!(
                "{arg}->size = {size} is smaller than the {arg} header ({HEADER_BYTES} bytes): initialise {type_name} with \
                 {init} or {init_fn}"
            )));
        }
        let mut out = initializer;
        let out_bytes = (&mut out as *mut T).cast::<u8>();
        // Whole fields only: a field cut by `size` counts as absent.
        let copied =
            self.fields.iter().map(|&(offset, len)| offset + len).take_while(|&end| end <= size).last().unwrap_or(0);
        // SAFETY: `copied` <= size bytes are readable at ptr; `out` is a plain repr(C) struct
        // of at least `copied` bytes whose every bit pattern is valid.
        std::ptr::copy_nonoverlapping(bytes, out_bytes, copied);
        let word_at = |offset: usize| std::ptr::read_unaligned(out_bytes.add(offset).cast::<u32>());
        if word_at(MAGIC_OFFSET) != self.magic {
            return Err(MkError::invalid_argument(format!(
                "{arg}->magic is wrong: initialise {type_name} with {init} (or {init_fn}) before setting fields"
            )));
        }
        let version = word_at(VERSION_OFFSET);
        let ours = crate::version_code() as u32;
        if version == 0 || version / 10000 != ours / 10000 {
            return Err(MkError::invalid_argument(format!(
                "{arg}->version = {version} is not a header version of this library's major version {} (this library is \
                 {}.{}.{}): initialise {type_name} with {init} from this library's mkernel.h, or with {init_fn}",
                ours / 10000,
                ours / 10000,
                ours / 100 % 100,
                ours % 100
            )));
        }
        let known = std::mem::size_of::<T>();
        if size > MAX_BYTES {
            return Err(MkError::invalid_argument(format!(
                "{arg}->size = {size} is larger than any {type_name} ({MAX_BYTES} bytes at most): initialise it with {init} \
                 or {init_fn}"
            )));
        }
        if size > known {
            let mut extra = vec![0u8; size - known];
            // SAFETY: bytes known..size are readable (size <= the caller's struct).
            std::ptr::copy_nonoverlapping(bytes.add(known), extra.as_mut_ptr(), extra.len());
            for (i, chunk) in extra.chunks(4).enumerate() {
                let mut word = [0u8; 4];
                word[..chunk.len()].copy_from_slice(chunk);
                let w = u32::from_ne_bytes(word);
                if !(self.unset_word)(w) {
                    return Err(MkError::invalid_argument(format!(
                        "{arg}->size = {size}: the {arg} comes from a newer header (this library's {type_name} has {known} \
                         bytes) and sets a field this library does not know (byte offset {}, word {w:#x}); leave newer \
                         fields unset or use a library as new as the header",
                        known + 4 * i
                    )));
                }
            }
        }
        Ok(out)
    }
}
