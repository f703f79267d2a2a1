# attnforge_write_if_changed(PATH TEXT): writes TEXT to PATH unless PATH already holds exactly TEXT, so generated
# sources keep their time stamps (and their dependents stay built) when nothing changed.
function(attnforge_write_if_changed path text)
  if(EXISTS "${path}")
    file(READ "${path}" old)
    if(old STREQUAL text)
      return()
    endif()
  endif()
  file(WRITE "${path}" "${text}")
endfunction()
